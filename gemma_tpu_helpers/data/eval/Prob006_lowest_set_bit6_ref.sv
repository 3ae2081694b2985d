module RefModule (
    input [5:0] in,
    output reg [2:0] pos,
    output [5:0] mask,
    output valid
);

    integer i;
    always @(*) begin
        pos = 3'd0;
        for (i = 5; i >= 0; i = i - 1)
            if (in[i])
                pos = i;
    end
    assign mask = in & (~in + 6'd1);
    assign valid = |in;

endmodule
