module RefModule (
    input [7:0] a,
    input [7:0] b,
    input [7:0] c,
    output reg [7:0] min_val,
    output reg [1:0] idx
);

    always @(*) begin
        min_val = a;
        idx = 2'd0;
        if (b < min_val) begin
            min_val = b;
            idx = 2'd1;
        end
        if (c < min_val) begin
            min_val = c;
            idx = 2'd2;
        end
    end

endmodule
