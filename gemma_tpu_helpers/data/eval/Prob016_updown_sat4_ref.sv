module RefModule (
    input clk,
    input areset_n,
    input up,
    input down,
    output reg [3:0] q
);

    always @(posedge clk or negedge areset_n) begin
        if (!areset_n)
            q <= 4'd0;
        else if (up && !down && q != 4'd15)
            q <= q + 4'd1;
        else if (down && !up && q != 4'd0)
            q <= q - 4'd1;
    end

endmodule
