module RefModule (
    input clk,
    input reset,
    input we,
    input [1:0] waddr,
    input [7:0] wdata,
    input [1:0] raddr0,
    input [1:0] raddr1,
    output [7:0] rdata0,
    output [7:0] rdata1
);

    reg [7:0] r1, r2, r3;
    always @(posedge clk) begin
        if (reset) begin
            r1 <= 8'd0;
            r2 <= 8'd0;
            r3 <= 8'd0;
        end else if (we) begin
            case (waddr)
                2'd1: r1 <= wdata;
                2'd2: r2 <= wdata;
                2'd3: r3 <= wdata;
                default: ;
            endcase
        end
    end
    assign rdata0 = (raddr0 == 2'd1) ? r1 : (raddr0 == 2'd2) ? r2 : (raddr0 == 2'd3) ? r3 : 8'd0;
    assign rdata1 = (raddr1 == 2'd1) ? r1 : (raddr1 == 2'd2) ? r2 : (raddr1 == 2'd3) ? r3 : 8'd0;

endmodule
