// Testbench for Prob005_leading_zeros8: drives TopModule and RefModule with the same
// stimulus and counts the samples where their outputs differ.
`timescale 1ns/1ps

module tb();
    reg clk = 1'b0;
    always #5 clk = ~clk;

    reg [7:0] in;
    wire [3:0] zeros_ref, zeros_dut;

    integer errors = 0;
    integer samples = 0;
    integer cycle;

    RefModule good1 (.in(in), .zeros(zeros_ref));
    TopModule top_module1 (.in(in), .zeros(zeros_dut));

    // An X in the reference matches anything; an X from TopModule matches only X.
    task check;
        begin
            samples = samples + 1;
            if ({zeros_ref} !== ({zeros_ref} ^ {zeros_dut} ^ {zeros_ref}))
                errors = errors + 1;
        end
    endtask

    initial begin
        in = 0;
        @(negedge clk);
        @(negedge clk);
        for (cycle = 0; cycle < 256; cycle = cycle + 1) begin
            in = cycle;
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
