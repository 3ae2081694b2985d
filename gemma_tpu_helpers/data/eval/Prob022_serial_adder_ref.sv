module RefModule (
    input clk,
    input reset,
    input a,
    input b,
    output s,
    output reg c
);

    assign s = a ^ b ^ c;
    always @(posedge clk) begin
        if (reset)
            c <= 1'b0;
        else
            c <= (a & b) | (a & c) | (b & c);
    end

endmodule
