module RefModule (
    input clk,
    input reset,
    input en,
    output reg [4:0] q
);

    always @(posedge clk) begin
        if (reset)
            q <= 5'b00001;
        else if (en)
            q <= {q[3:0], q[4] ^ q[2]};
    end

endmodule
