module RefModule (
    input [7:0] in,
    output zero,
    output onehot,
    output multi
);

    assign zero   = (in == 8'd0);
    assign onehot = !zero && ((in & (in - 8'd1)) == 8'd0);
    assign multi  = !zero && !onehot;

endmodule
