module RefModule (
    input clk,
    input reset,
    input load,
    input [5:0] value,
    output reg [5:0] count,
    output done
);

    always @(posedge clk) begin
        if (reset)
            count <= 6'd0;
        else if (load)
            count <= value;
        else if (count != 6'd0)
            count <= count - 6'd1;
    end
    assign done = (count == 6'd0);

endmodule
