// Testbench for Prob012_onehot_check8: drives TopModule and RefModule with the same
// stimulus and counts the samples where their outputs differ.
`timescale 1ns/1ps

module tb();
    reg clk = 1'b0;
    always #5 clk = ~clk;

    reg [7:0] in;
    wire zero_ref, zero_dut;
    wire onehot_ref, onehot_dut;
    wire multi_ref, multi_dut;

    integer errors = 0;
    integer samples = 0;
    integer cycle;

    RefModule good1 (.in(in), .zero(zero_ref), .onehot(onehot_ref), .multi(multi_ref));
    TopModule top_module1 (.in(in), .zero(zero_dut), .onehot(onehot_dut), .multi(multi_dut));

    // An X in the reference matches anything; an X from TopModule matches only X.
    task check;
        begin
            samples = samples + 1;
            if ({zero_ref, onehot_ref, multi_ref} !== ({zero_ref, onehot_ref, multi_ref} ^ {zero_dut, onehot_dut, multi_dut} ^ {zero_ref, onehot_ref, multi_ref}))
                errors = errors + 1;
        end
    endtask

    initial begin
        in = 0;
        @(negedge clk);
        @(negedge clk);
        for (cycle = 0; cycle < 300; cycle = cycle + 1) begin
            in = $random; if (cycle % 3 == 1) in = 8'd1 << (cycle % 8); if (cycle % 17 == 0) in = 8'd0;
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
