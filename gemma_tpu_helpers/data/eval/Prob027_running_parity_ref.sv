module RefModule (
    input clk,
    input reset,
    input clear,
    input in,
    output reg odd
);

    always @(posedge clk) begin
        if (reset || clear)
            odd <= 1'b0;
        else
            odd <= odd ^ in;
    end

endmodule
