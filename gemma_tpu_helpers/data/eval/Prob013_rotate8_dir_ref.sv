module RefModule (
    input [7:0] data,
    input [2:0] amt,
    input left,
    output [7:0] out
);

    wire [15:0] dl = {data, data} << amt;
    wire [15:0] dr = {data, data} >> amt;
    assign out = left ? dl[15:8] : dr[7:0];

endmodule
