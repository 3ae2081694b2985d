module RefModule (
    input [3:0] a,
    input [3:0] b,
    input [1:0] op,
    output reg [3:0] y,
    output zero,
    output reg carry
);

    always @(*) begin
        carry = 1'b0;
        case (op)
            2'd0: {carry, y} = a + b;
            2'd1: {carry, y} = {1'b0, a} - {1'b0, b};
            2'd2: y = a & b;
            default: y = a ^ b;
        endcase
    end
    assign zero = (y == 4'd0);

endmodule
