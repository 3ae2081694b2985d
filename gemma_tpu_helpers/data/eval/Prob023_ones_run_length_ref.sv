module RefModule (
    input clk,
    input reset,
    input in,
    output reg [3:0] run
);

    always @(posedge clk) begin
        if (reset || !in)
            run <= 4'd0;
        else if (run != 4'd15)
            run <= run + 4'd1;
    end

endmodule
