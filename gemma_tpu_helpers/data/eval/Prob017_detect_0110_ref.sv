module RefModule (
    input clk,
    input reset,
    input in,
    output z
);

    localparam S0 = 3'd0, S1 = 3'd1, S2 = 3'd2, S3 = 3'd3, S4 = 3'd4;
    reg [2:0] state, next;
    always @(*) begin
        case (state)
            S0: next = in ? S0 : S1;
            S1: next = in ? S2 : S1;
            S2: next = in ? S3 : S1;
            S3: next = in ? S0 : S4;
            S4: next = in ? S2 : S1;
            default: next = S0;
        endcase
    end
    always @(posedge clk) begin
        if (reset)
            state <= S0;
        else
            state <= next;
    end
    assign z = (state == S4);

endmodule
