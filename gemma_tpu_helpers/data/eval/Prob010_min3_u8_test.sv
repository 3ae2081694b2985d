// Testbench for Prob010_min3_u8: drives TopModule and RefModule with the same
// stimulus and counts the samples where their outputs differ.
`timescale 1ns/1ps

module tb();
    reg clk = 1'b0;
    always #5 clk = ~clk;

    reg [7:0] a;
    reg [7:0] b;
    reg [7:0] c;
    wire [7:0] min_val_ref, min_val_dut;
    wire [1:0] idx_ref, idx_dut;

    integer errors = 0;
    integer samples = 0;
    integer cycle;

    RefModule good1 (.a(a), .b(b), .c(c), .min_val(min_val_ref), .idx(idx_ref));
    TopModule top_module1 (.a(a), .b(b), .c(c), .min_val(min_val_dut), .idx(idx_dut));

    // An X in the reference matches anything; an X from TopModule matches only X.
    task check;
        begin
            samples = samples + 1;
            if ({min_val_ref, idx_ref} !== ({min_val_ref, idx_ref} ^ {min_val_dut, idx_dut} ^ {min_val_ref, idx_ref}))
                errors = errors + 1;
        end
    endtask

    initial begin
        a = 0; b = 0; c = 0;
        @(negedge clk);
        @(negedge clk);
        for (cycle = 0; cycle < 300; cycle = cycle + 1) begin
            a = $random; b = $random; c = $random; if (cycle % 5 == 0) b = a; if (cycle % 7 == 0) c = a; if (cycle % 6 == 1) c = b;
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
