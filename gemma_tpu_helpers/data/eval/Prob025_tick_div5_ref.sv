module RefModule (
    input clk,
    input reset,
    input en,
    output tick
);

    reg [2:0] cnt;
    always @(posedge clk) begin
        if (reset)
            cnt <= 3'd0;
        else if (en)
            cnt <= (cnt == 3'd4) ? 3'd0 : cnt + 3'd1;
    end
    assign tick = (cnt == 3'd4);

endmodule
