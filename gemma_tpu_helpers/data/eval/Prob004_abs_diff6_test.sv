// Testbench for Prob004_abs_diff6: drives TopModule and RefModule with the same
// stimulus and counts the samples where their outputs differ.
`timescale 1ns/1ps

module tb();
    reg clk = 1'b0;
    always #5 clk = ~clk;

    reg [5:0] a;
    reg [5:0] b;
    wire [5:0] diff_ref, diff_dut;
    wire b_larger_ref, b_larger_dut;

    integer errors = 0;
    integer samples = 0;
    integer cycle;

    RefModule good1 (.a(a), .b(b), .diff(diff_ref), .b_larger(b_larger_ref));
    TopModule top_module1 (.a(a), .b(b), .diff(diff_dut), .b_larger(b_larger_dut));

    // An X in the reference matches anything; an X from TopModule matches only X.
    task check;
        begin
            samples = samples + 1;
            if ({diff_ref, b_larger_ref} !== ({diff_ref, b_larger_ref} ^ {diff_dut, b_larger_dut} ^ {diff_ref, b_larger_ref}))
                errors = errors + 1;
        end
    endtask

    initial begin
        a = 0; b = 0;
        @(negedge clk);
        @(negedge clk);
        for (cycle = 0; cycle < 4096; cycle = cycle + 1) begin
            {a, b} = cycle;
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
