// Testbench for Prob006_lowest_set_bit6: drives TopModule and RefModule with the same
// stimulus and counts the samples where their outputs differ.
`timescale 1ns/1ps

module tb();
    reg clk = 1'b0;
    always #5 clk = ~clk;

    reg [5:0] in;
    wire [2:0] pos_ref, pos_dut;
    wire [5:0] mask_ref, mask_dut;
    wire valid_ref, valid_dut;

    integer errors = 0;
    integer samples = 0;
    integer cycle;

    RefModule good1 (.in(in), .pos(pos_ref), .mask(mask_ref), .valid(valid_ref));
    TopModule top_module1 (.in(in), .pos(pos_dut), .mask(mask_dut), .valid(valid_dut));

    // An X in the reference matches anything; an X from TopModule matches only X.
    task check;
        begin
            samples = samples + 1;
            if ({pos_ref, mask_ref, valid_ref} !== ({pos_ref, mask_ref, valid_ref} ^ {pos_dut, mask_dut, valid_dut} ^ {pos_ref, mask_ref, valid_ref}))
                errors = errors + 1;
        end
    endtask

    initial begin
        in = 0;
        @(negedge clk);
        @(negedge clk);
        for (cycle = 0; cycle < 64; cycle = cycle + 1) begin
            in = cycle;
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
