// Testbench for Prob007_bcd_digit_inc: drives TopModule and RefModule with the same
// stimulus and counts the samples where their outputs differ.
`timescale 1ns/1ps

module tb();
    reg clk = 1'b0;
    always #5 clk = ~clk;

    reg [3:0] d;
    reg inc;
    wire [3:0] q_ref, q_dut;
    wire carry_ref, carry_dut;

    integer errors = 0;
    integer samples = 0;
    integer cycle;

    RefModule good1 (.d(d), .inc(inc), .q(q_ref), .carry(carry_ref));
    TopModule top_module1 (.d(d), .inc(inc), .q(q_dut), .carry(carry_dut));

    // An X in the reference matches anything; an X from TopModule matches only X.
    task check;
        begin
            samples = samples + 1;
            if ({q_ref, carry_ref} !== ({q_ref, carry_ref} ^ {q_dut, carry_dut} ^ {q_ref, carry_ref}))
                errors = errors + 1;
        end
    endtask

    initial begin
        d = 0; inc = 0;
        @(negedge clk);
        @(negedge clk);
        for (cycle = 0; cycle < 32; cycle = cycle + 1) begin
            {d, inc} = cycle;
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
