// Testbench for Prob011_hex_to_7seg_n: drives TopModule and RefModule with the same
// stimulus and counts the samples where their outputs differ.
`timescale 1ns/1ps

module tb();
    reg clk = 1'b0;
    always #5 clk = ~clk;

    reg [3:0] hex;
    wire [6:0] seg_n_ref, seg_n_dut;

    integer errors = 0;
    integer samples = 0;
    integer cycle;

    RefModule good1 (.hex(hex), .seg_n(seg_n_ref));
    TopModule top_module1 (.hex(hex), .seg_n(seg_n_dut));

    // An X in the reference matches anything; an X from TopModule matches only X.
    task check;
        begin
            samples = samples + 1;
            if ({seg_n_ref} !== ({seg_n_ref} ^ {seg_n_dut} ^ {seg_n_ref}))
                errors = errors + 1;
        end
    endtask

    initial begin
        hex = 0;
        @(negedge clk);
        @(negedge clk);
        for (cycle = 0; cycle < 32; cycle = cycle + 1) begin
            hex = cycle;
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
