module RefModule (
    input clk,
    input reset,
    input trig,
    output busy
);

    reg [2:0] cnt;
    always @(posedge clk) begin
        if (reset)
            cnt <= 3'd0;
        else if (trig)
            cnt <= 3'd4;
        else if (cnt != 3'd0)
            cnt <= cnt - 3'd1;
    end
    assign busy = (cnt != 3'd0);

endmodule
