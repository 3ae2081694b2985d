module RefModule (
    input [9:0] in,
    output reg [9:0] out,
    output palindrome
);

    integer i;
    always @(*)
        for (i = 0; i < 10; i = i + 1)
            out[i] = in[9 - i];
    assign palindrome = (out == in);

endmodule
