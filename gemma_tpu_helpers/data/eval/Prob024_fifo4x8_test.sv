// Testbench for Prob024_fifo4x8: drives TopModule and RefModule with the same
// stimulus and counts the samples where their outputs differ.
`timescale 1ns/1ps

module tb();
    reg clk = 1'b0;
    always #5 clk = ~clk;

    reg reset;
    reg push;
    reg pop;
    reg [7:0] din;
    wire [7:0] dout_ref, dout_dut;
    wire [2:0] count_ref, count_dut;
    wire full_ref, full_dut;
    wire empty_ref, empty_dut;

    integer errors = 0;
    integer samples = 0;
    integer cycle;

    RefModule good1 (.clk(clk), .reset(reset), .push(push), .pop(pop), .din(din), .dout(dout_ref), .count(count_ref), .full(full_ref), .empty(empty_ref));
    TopModule top_module1 (.clk(clk), .reset(reset), .push(push), .pop(pop), .din(din), .dout(dout_dut), .count(count_dut), .full(full_dut), .empty(empty_dut));

    // An X in the reference matches anything; an X from TopModule matches only X.
    task check;
        begin
            samples = samples + 1;
            if ({dout_ref, count_ref, full_ref, empty_ref} !== ({dout_ref, count_ref, full_ref, empty_ref} ^ {dout_dut, count_dut, full_dut, empty_dut} ^ {dout_ref, count_ref, full_ref, empty_ref}))
                errors = errors + 1;
        end
    endtask

    initial begin
        reset = 1; push = 0; pop = 0; din = 0;
        @(negedge clk);
        @(negedge clk);
        for (cycle = 0; cycle < 500; cycle = cycle + 1) begin
            reset = ($random & 255) == 0;
            din = $random;
            if ((cycle / 40) % 2 == 0) begin  // mostly filling
                push = ($random & 3) != 0;
                pop = ($random & 3) == 0;
            end else begin                    // mostly draining
                push = ($random & 3) == 0;
                pop = ($random & 3) != 0;
            end
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
