// Testbench for Prob002_mux3_8bit: drives TopModule and RefModule with the same
// stimulus and counts the samples where their outputs differ.
`timescale 1ns/1ps

module tb();
    reg clk = 1'b0;
    always #5 clk = ~clk;

    reg [7:0] a;
    reg [7:0] b;
    reg [7:0] c;
    reg [1:0] sel;
    wire [7:0] out_ref, out_dut;

    integer errors = 0;
    integer samples = 0;
    integer cycle;

    RefModule good1 (.a(a), .b(b), .c(c), .sel(sel), .out(out_ref));
    TopModule top_module1 (.a(a), .b(b), .c(c), .sel(sel), .out(out_dut));

    // An X in the reference matches anything; an X from TopModule matches only X.
    task check;
        begin
            samples = samples + 1;
            if ({out_ref} !== ({out_ref} ^ {out_dut} ^ {out_ref}))
                errors = errors + 1;
        end
    endtask

    initial begin
        a = 0; b = 0; c = 0; sel = 0;
        @(negedge clk);
        @(negedge clk);
        for (cycle = 0; cycle < 200; cycle = cycle + 1) begin
            a = $random; b = $random; c = $random; sel = $random;
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
