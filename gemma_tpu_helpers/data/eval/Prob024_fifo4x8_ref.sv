module RefModule (
    input clk,
    input reset,
    input push,
    input pop,
    input [7:0] din,
    output [7:0] dout,
    output reg [2:0] count,
    output full,
    output empty
);

    reg [7:0] mem [0:3];
    reg [1:0] rd_ptr, wr_ptr;
    wire do_push = push && (count != 3'd4);
    wire do_pop  = pop && (count != 3'd0);
    assign full  = (count == 3'd4);
    assign empty = (count == 3'd0);
    assign dout  = empty ? 8'd0 : mem[rd_ptr];
    always @(posedge clk) begin
        if (reset) begin
            rd_ptr <= 2'd0;
            wr_ptr <= 2'd0;
            count <= 3'd0;
        end else begin
            if (do_push) begin
                mem[wr_ptr] <= din;
                wr_ptr <= wr_ptr + 2'd1;
            end
            if (do_pop)
                rd_ptr <= rd_ptr + 2'd1;
            count <= count + do_push - do_pop;
        end
    end

endmodule
