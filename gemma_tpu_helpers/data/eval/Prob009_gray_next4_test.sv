// Testbench for Prob009_gray_next4: drives TopModule and RefModule with the same
// stimulus and counts the samples where their outputs differ.
`timescale 1ns/1ps

module tb();
    reg clk = 1'b0;
    always #5 clk = ~clk;

    reg [3:0] g;
    wire [3:0] next_ref, next_dut;

    integer errors = 0;
    integer samples = 0;
    integer cycle;

    RefModule good1 (.g(g), .next(next_ref));
    TopModule top_module1 (.g(g), .next(next_dut));

    // An X in the reference matches anything; an X from TopModule matches only X.
    task check;
        begin
            samples = samples + 1;
            if ({next_ref} !== ({next_ref} ^ {next_dut} ^ {next_ref}))
                errors = errors + 1;
        end
    endtask

    initial begin
        g = 0;
        @(negedge clk);
        @(negedge clk);
        for (cycle = 0; cycle < 16; cycle = cycle + 1) begin
            g = cycle;
            #2 check;
            @(negedge clk);
            check;
        end
        $display("Mismatches: %1d in %1d samples", errors, samples);
        $finish;
    end

    initial begin
        #1000000 $display("TIMEOUT");
        $finish;
    end
endmodule
