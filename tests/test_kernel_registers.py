"""benchmarks/kernel_registers.py's count of a kernel's machine code, on a listing written here."""

from kernel_registers import opcodes

# nvdisasm -c's shape: a label on a line of its own, an instruction after its address, a predicate before some
LISTING = """
        .text.kernel:
        /*0000*/                   LDC R1, c[0x0][0x28] ;
        /*0010*/               @P0 BRA `(.L_x_0) ;
.L_x_1:
        /*0020*/                   LDG.E.128 R4, desc[UR4][R2.64] ;
        /*0030*/                   STS.128 [R0], R4 ;
        /*0040*/                   BAR.SYNC.DEFER_BLOCKING 0x0 ;
        /*0050*/                   LDS.128 R8, [R0] ;
        /*0060*/              @!P1 BRA `(.L_x_1) ;
.L_x_0:
        /*0070*/                   EXIT ;
.L_x_2:
        /*0080*/                   BRA `(.L_x_2);
"""


def test_the_listing_is_counted_with_its_loop_and_its_layout_changes():
    """Nine instructions; the longest loop is the five from its label to the branch back, that branch included
    (the branch forward past it is none, the end's branch to itself a loop of one); one barrier, two shared
    accesses."""
    counts = opcodes(LISTING)
    assert counts == {"instructions": 9, "longest loop": 5, "barriers": 1, "shared accesses": 2}
