module RefModule (
    input [7:0] a,
    input [7:0] b,
    output [7:0] sum,
    output overflow
);

    wire [8:0] full = a + b;
    assign overflow = full[8];
    assign sum = full[8] ? 8'hff : full[7:0];

endmodule
