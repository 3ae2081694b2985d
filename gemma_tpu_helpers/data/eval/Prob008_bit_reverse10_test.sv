// Testbench for Prob008_bit_reverse10: drives TopModule and RefModule with the same
// stimulus and counts the samples where their outputs differ.
`timescale 1ns/1ps

module tb();
    reg clk = 1'b0;
    always #5 clk = ~clk;

    reg [9:0] in;
    wire [9:0] out_ref, out_dut;
    wire palindrome_ref, palindrome_dut;

    integer errors = 0;
    integer samples = 0;
    integer cycle;

    RefModule good1 (.in(in), .out(out_ref), .palindrome(palindrome_ref));
    TopModule top_module1 (.in(in), .out(out_dut), .palindrome(palindrome_dut));

    // An X in the reference matches anything; an X from TopModule matches only X.
    task check;
        begin
            samples = samples + 1;
            if ({out_ref, palindrome_ref} !== ({out_ref, palindrome_ref} ^ {out_dut, palindrome_dut} ^ {out_ref, palindrome_ref}))
                errors = errors + 1;
        end
    endtask

    initial begin
        in = 0;
        @(negedge clk);
        @(negedge clk);
        for (cycle = 0; cycle < 300; cycle = cycle + 1) begin
            in = $random; if (cycle % 4 == 0) in[4:0] = {in[5], in[6], in[7], in[8], in[9]};
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
