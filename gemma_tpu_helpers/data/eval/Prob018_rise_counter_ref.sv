module RefModule (
    input clk,
    input reset,
    input sig,
    output rise,
    output reg [5:0] count
);

    reg prev;
    assign rise = sig & ~prev;
    always @(posedge clk) begin
        if (reset) begin
            prev <= 1'b0;
            count <= 6'd0;
        end else begin
            prev <= sig;
            if (rise)
                count <= count + 6'd1;
        end
    end

endmodule
