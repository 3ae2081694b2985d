module RefModule (
    input [3:0] hex,
    output reg [6:0] seg_n
);

    always @(*) begin
        case (hex)
            4'h0: seg_n = ~7'h3f;
            4'h1: seg_n = ~7'h06;
            4'h2: seg_n = ~7'h5b;
            4'h3: seg_n = ~7'h4f;
            4'h4: seg_n = ~7'h66;
            4'h5: seg_n = ~7'h6d;
            4'h6: seg_n = ~7'h7d;
            4'h7: seg_n = ~7'h07;
            4'h8: seg_n = ~7'h7f;
            4'h9: seg_n = ~7'h6f;
            4'ha: seg_n = ~7'h77;
            4'hb: seg_n = ~7'h7c;
            4'hc: seg_n = ~7'h39;
            4'hd: seg_n = ~7'h5e;
            4'he: seg_n = ~7'h79;
            default: seg_n = ~7'h71;
        endcase
    end

endmodule
