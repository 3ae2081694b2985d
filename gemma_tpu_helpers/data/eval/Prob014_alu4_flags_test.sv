// Testbench for Prob014_alu4_flags: drives TopModule and RefModule with the same
// stimulus and counts the samples where their outputs differ.
`timescale 1ns/1ps

module tb();
    reg clk = 1'b0;
    always #5 clk = ~clk;

    reg [3:0] a;
    reg [3:0] b;
    reg [1:0] op;
    wire [3:0] y_ref, y_dut;
    wire zero_ref, zero_dut;
    wire carry_ref, carry_dut;

    integer errors = 0;
    integer samples = 0;
    integer cycle;

    RefModule good1 (.a(a), .b(b), .op(op), .y(y_ref), .zero(zero_ref), .carry(carry_ref));
    TopModule top_module1 (.a(a), .b(b), .op(op), .y(y_dut), .zero(zero_dut), .carry(carry_dut));

    // An X in the reference matches anything; an X from TopModule matches only X.
    task check;
        begin
            samples = samples + 1;
            if ({y_ref, zero_ref, carry_ref} !== ({y_ref, zero_ref, carry_ref} ^ {y_dut, zero_dut, carry_dut} ^ {y_ref, zero_ref, carry_ref}))
                errors = errors + 1;
        end
    endtask

    initial begin
        a = 0; b = 0; op = 0;
        @(negedge clk);
        @(negedge clk);
        for (cycle = 0; cycle < 1024; cycle = cycle + 1) begin
            {op, a, b} = cycle;
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
