// Testbench for Prob027_running_parity: drives TopModule and RefModule with the same
// stimulus and counts the samples where their outputs differ.
`timescale 1ns/1ps

module tb();
    reg clk = 1'b0;
    always #5 clk = ~clk;

    reg reset;
    reg clear;
    reg in;
    wire odd_ref, odd_dut;

    integer errors = 0;
    integer samples = 0;
    integer cycle;

    RefModule good1 (.clk(clk), .reset(reset), .clear(clear), .in(in), .odd(odd_ref));
    TopModule top_module1 (.clk(clk), .reset(reset), .clear(clear), .in(in), .odd(odd_dut));

    // An X in the reference matches anything; an X from TopModule matches only X.
    task check;
        begin
            samples = samples + 1;
            if ({odd_ref} !== ({odd_ref} ^ {odd_dut} ^ {odd_ref}))
                errors = errors + 1;
        end
    endtask

    initial begin
        reset = 1; clear = 0; in = 0;
        @(negedge clk);
        @(negedge clk);
        for (cycle = 0; cycle < 400; cycle = cycle + 1) begin
            reset = ($random & 255) == 0; clear = ($random & 31) == 0; in = $random;
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
