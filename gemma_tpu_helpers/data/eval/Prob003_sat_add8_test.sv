// Testbench for Prob003_sat_add8: drives TopModule and RefModule with the same
// stimulus and counts the samples where their outputs differ.
`timescale 1ns/1ps

module tb();
    reg clk = 1'b0;
    always #5 clk = ~clk;

    reg [7:0] a;
    reg [7:0] b;
    wire [7:0] sum_ref, sum_dut;
    wire overflow_ref, overflow_dut;

    integer errors = 0;
    integer samples = 0;
    integer cycle;

    RefModule good1 (.a(a), .b(b), .sum(sum_ref), .overflow(overflow_ref));
    TopModule top_module1 (.a(a), .b(b), .sum(sum_dut), .overflow(overflow_dut));

    // An X in the reference matches anything; an X from TopModule matches only X.
    task check;
        begin
            samples = samples + 1;
            if ({sum_ref, overflow_ref} !== ({sum_ref, overflow_ref} ^ {sum_dut, overflow_dut} ^ {sum_ref, overflow_ref}))
                errors = errors + 1;
        end
    endtask

    initial begin
        a = 0; b = 0;
        @(negedge clk);
        @(negedge clk);
        for (cycle = 0; cycle < 300; cycle = cycle + 1) begin
            a = $random; b = $random;
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
