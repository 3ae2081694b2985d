module RefModule (
    input [3:0] d,
    input inc,
    output reg [3:0] q,
    output reg carry
);

    always @(*) begin
        q = 4'd0;
        carry = 1'b0;
        if (d <= 4'd9) begin
            if (!inc)
                q = d;
            else if (d == 4'd9)
                carry = 1'b1;
            else
                q = d + 4'd1;
        end
    end

endmodule
