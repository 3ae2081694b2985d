// Testbench for Prob022_serial_adder: drives TopModule and RefModule with the same
// stimulus and counts the samples where their outputs differ.
`timescale 1ns/1ps

module tb();
    reg clk = 1'b0;
    always #5 clk = ~clk;

    reg reset;
    reg a;
    reg b;
    wire s_ref, s_dut;
    wire c_ref, c_dut;

    integer errors = 0;
    integer samples = 0;
    integer cycle;

    RefModule good1 (.clk(clk), .reset(reset), .a(a), .b(b), .s(s_ref), .c(c_ref));
    TopModule top_module1 (.clk(clk), .reset(reset), .a(a), .b(b), .s(s_dut), .c(c_dut));

    // An X in the reference matches anything; an X from TopModule matches only X.
    task check;
        begin
            samples = samples + 1;
            if ({s_ref, c_ref} !== ({s_ref, c_ref} ^ {s_dut, c_dut} ^ {s_ref, c_ref}))
                errors = errors + 1;
        end
    endtask

    initial begin
        reset = 1; a = 0; b = 0;
        @(negedge clk);
        @(negedge clk);
        for (cycle = 0; cycle < 400; cycle = cycle + 1) begin
            reset = (cycle % 16) == 15; a = $random; b = $random;
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
