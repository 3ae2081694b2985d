module RefModule (
    input [7:0] in,
    output reg [3:0] zeros
);

    integer i;
    reg found;
    always @(*) begin
        zeros = 4'd0;
        found = 1'b0;
        for (i = 7; i >= 0; i = i - 1) begin
            if (in[i])
                found = 1'b1;
            else if (!found)
                zeros = zeros + 4'd1;
        end
    end

endmodule
