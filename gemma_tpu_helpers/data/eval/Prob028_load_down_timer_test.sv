// Testbench for Prob028_load_down_timer: drives TopModule and RefModule with the same
// stimulus and counts the samples where their outputs differ.
`timescale 1ns/1ps

module tb();
    reg clk = 1'b0;
    always #5 clk = ~clk;

    reg reset;
    reg load;
    reg [5:0] value;
    wire [5:0] count_ref, count_dut;
    wire done_ref, done_dut;

    integer errors = 0;
    integer samples = 0;
    integer cycle;

    RefModule good1 (.clk(clk), .reset(reset), .load(load), .value(value), .count(count_ref), .done(done_ref));
    TopModule top_module1 (.clk(clk), .reset(reset), .load(load), .value(value), .count(count_dut), .done(done_dut));

    // An X in the reference matches anything; an X from TopModule matches only X.
    task check;
        begin
            samples = samples + 1;
            if ({count_ref, done_ref} !== ({count_ref, done_ref} ^ {count_dut, done_dut} ^ {count_ref, done_ref}))
                errors = errors + 1;
        end
    endtask

    initial begin
        reset = 1; load = 0; value = 0;
        @(negedge clk);
        @(negedge clk);
        for (cycle = 0; cycle < 600; cycle = cycle + 1) begin
            reset = ($random & 127) == 0; load = reset ? $random : (($random & 31) == 0); value = $random;
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
