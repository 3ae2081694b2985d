// Testbench for Prob021_pulse_stretch4: drives TopModule and RefModule with the same
// stimulus and counts the samples where their outputs differ.
`timescale 1ns/1ps

module tb();
    reg clk = 1'b0;
    always #5 clk = ~clk;

    reg reset;
    reg trig;
    wire busy_ref, busy_dut;

    integer errors = 0;
    integer samples = 0;
    integer cycle;

    RefModule good1 (.clk(clk), .reset(reset), .trig(trig), .busy(busy_ref));
    TopModule top_module1 (.clk(clk), .reset(reset), .trig(trig), .busy(busy_dut));

    // An X in the reference matches anything; an X from TopModule matches only X.
    task check;
        begin
            samples = samples + 1;
            if ({busy_ref} !== ({busy_ref} ^ {busy_dut} ^ {busy_ref}))
                errors = errors + 1;
        end
    endtask

    initial begin
        reset = 1; trig = 0;
        @(negedge clk);
        @(negedge clk);
        for (cycle = 0; cycle < 500; cycle = cycle + 1) begin
            reset = ($random & 127) == 0; trig = ($random & 15) == 0;
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
