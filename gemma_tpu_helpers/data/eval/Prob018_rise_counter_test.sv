// Testbench for Prob018_rise_counter: drives TopModule and RefModule with the same
// stimulus and counts the samples where their outputs differ.
`timescale 1ns/1ps

module tb();
    reg clk = 1'b0;
    always #5 clk = ~clk;

    reg reset;
    reg sig;
    wire rise_ref, rise_dut;
    wire [5:0] count_ref, count_dut;

    integer errors = 0;
    integer samples = 0;
    integer cycle;

    RefModule good1 (.clk(clk), .reset(reset), .sig(sig), .rise(rise_ref), .count(count_ref));
    TopModule top_module1 (.clk(clk), .reset(reset), .sig(sig), .rise(rise_dut), .count(count_dut));

    // An X in the reference matches anything; an X from TopModule matches only X.
    task check;
        begin
            samples = samples + 1;
            if ({rise_ref, count_ref} !== ({rise_ref, count_ref} ^ {rise_dut, count_dut} ^ {rise_ref, count_ref}))
                errors = errors + 1;
        end
    endtask

    initial begin
        reset = 1; sig = 0;
        @(negedge clk);
        @(negedge clk);
        for (cycle = 0; cycle < 600; cycle = cycle + 1) begin
            reset = ($random & 255) == 0; sig = $random;
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
