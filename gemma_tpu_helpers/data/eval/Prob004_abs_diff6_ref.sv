module RefModule (
    input [5:0] a,
    input [5:0] b,
    output [5:0] diff,
    output b_larger
);

    assign b_larger = (b > a);
    assign diff = b_larger ? (b - a) : (a - b);

endmodule
