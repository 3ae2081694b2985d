// Testbench for Prob001_majority3: drives TopModule and RefModule with the same
// stimulus and counts the samples where their outputs differ.
`timescale 1ns/1ps

module tb();
    reg clk = 1'b0;
    always #5 clk = ~clk;

    reg a;
    reg b;
    reg c;
    wire y_ref, y_dut;

    integer errors = 0;
    integer samples = 0;
    integer cycle;

    RefModule good1 (.a(a), .b(b), .c(c), .y(y_ref));
    TopModule top_module1 (.a(a), .b(b), .c(c), .y(y_dut));

    // An X in the reference matches anything; an X from TopModule matches only X.
    task check;
        begin
            samples = samples + 1;
            if ({y_ref} !== ({y_ref} ^ {y_dut} ^ {y_ref}))
                errors = errors + 1;
        end
    endtask

    initial begin
        {a, b, c} = 3'b000;
        @(negedge clk);
        @(negedge clk);
        for (cycle = 0; cycle < 16; cycle = cycle + 1) begin
            {a, b, c} = cycle;
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
