module RefModule (
    input [7:0] a,
    input [7:0] b,
    input [7:0] c,
    input [1:0] sel,
    output reg [7:0] out
);

    always @(*) begin
        case (sel)
            2'd0: out = a;
            2'd1: out = b;
            2'd2: out = c;
            default: out = 8'd0;
        endcase
    end

endmodule
