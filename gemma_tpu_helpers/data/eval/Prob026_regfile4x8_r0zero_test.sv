// Testbench for Prob026_regfile4x8_r0zero: drives TopModule and RefModule with the same
// stimulus and counts the samples where their outputs differ.
`timescale 1ns/1ps

module tb();
    reg clk = 1'b0;
    always #5 clk = ~clk;

    reg reset;
    reg we;
    reg [1:0] waddr;
    reg [7:0] wdata;
    reg [1:0] raddr0;
    reg [1:0] raddr1;
    wire [7:0] rdata0_ref, rdata0_dut;
    wire [7:0] rdata1_ref, rdata1_dut;

    integer errors = 0;
    integer samples = 0;
    integer cycle;

    RefModule good1 (.clk(clk), .reset(reset), .we(we), .waddr(waddr), .wdata(wdata), .raddr0(raddr0), .raddr1(raddr1), .rdata0(rdata0_ref), .rdata1(rdata1_ref));
    TopModule top_module1 (.clk(clk), .reset(reset), .we(we), .waddr(waddr), .wdata(wdata), .raddr0(raddr0), .raddr1(raddr1), .rdata0(rdata0_dut), .rdata1(rdata1_dut));

    // An X in the reference matches anything; an X from TopModule matches only X.
    task check;
        begin
            samples = samples + 1;
            if ({rdata0_ref, rdata1_ref} !== ({rdata0_ref, rdata1_ref} ^ {rdata0_dut, rdata1_dut} ^ {rdata0_ref, rdata1_ref}))
                errors = errors + 1;
        end
    endtask

    initial begin
        reset = 1; we = 0; waddr = 0; wdata = 0; raddr0 = 0; raddr1 = 0;
        @(negedge clk);
        @(negedge clk);
        for (cycle = 0; cycle < 400; cycle = cycle + 1) begin
            reset = ($random & 255) == 0; we = $random; waddr = $random; wdata = $random; raddr0 = $random; raddr1 = $random;
            #2 check;
            @(negedge clk);
            check;
        end
        $display("Mismatches: %1d in %1d samples", errors, samples);
        $finish;
    end

    initial begin
        #1000000 $display("TIMEOUT");
        $finish;
    end
endmodule
