module RefModule (
    input [3:0] g,
    output [3:0] next
);

    wire [3:0] b = {g[3], g[3] ^ g[2], g[3] ^ g[2] ^ g[1], g[3] ^ g[2] ^ g[1] ^ g[0]};
    wire [3:0] b1 = b + 4'd1;
    assign next = b1 ^ (b1 >> 1);

endmodule
