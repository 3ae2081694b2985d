// Testbench for Prob016_updown_sat4: drives TopModule and RefModule with the same
// stimulus and counts the samples where their outputs differ.
`timescale 1ns/1ps

module tb();
    reg clk = 1'b0;
    always #5 clk = ~clk;

    reg areset_n;
    reg up;
    reg down;
    wire [3:0] q_ref, q_dut;

    integer errors = 0;
    integer samples = 0;
    integer cycle;

    RefModule good1 (.clk(clk), .areset_n(areset_n), .up(up), .down(down), .q(q_ref));
    TopModule top_module1 (.clk(clk), .areset_n(areset_n), .up(up), .down(down), .q(q_dut));

    // An X in the reference matches anything; an X from TopModule matches only X.
    task check;
        begin
            samples = samples + 1;
            if ({q_ref} !== ({q_ref} ^ {q_dut} ^ {q_ref}))
                errors = errors + 1;
        end
    endtask

    initial begin
        areset_n = 0; up = 0; down = 0;
        @(negedge clk);
        @(negedge clk);
        for (cycle = 0; cycle < 400; cycle = cycle + 1) begin
            areset_n = ($random & 63) != 0;
            if ((cycle / 50) % 2 == 0) begin  // mostly counting up
                up = ($random & 3) != 0;
                down = ($random & 3) == 0;
            end else begin                    // mostly counting down
                up = ($random & 3) == 0;
                down = ($random & 3) != 0;
            end
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
