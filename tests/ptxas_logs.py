"""ptxas -v logs as nvcc prints them, for the tests of the parser (``flashgen.ptxas``) and of what a build keeps."""

LOG_SM80 = """\
ptxas info    : 4096 bytes gmem
ptxas info    : Compiling entry function '_ZN3foo6kernelENS_6ParamsE' for 'sm_80'
ptxas info    : Function properties for _ZN3foo6kernelENS_6ParamsE
    16 bytes stack frame, 16 bytes spill stores, 24 bytes spill loads
ptxas info    : Used 255 registers, used 1 barriers, 16 bytes cumulative stack size, 488 bytes cmem[0]
ptxas info    : Compile time = 575.211 ms
"""

LOG_SM90 = """\
ptxas info    : Function properties for _Z6helperv
    8 bytes stack frame, 4 bytes spill stores, 4 bytes spill loads
ptxas info    : Compiling entry function 'k' for 'sm_90a'
ptxas info    : Function properties for k
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 6 registers, used 1 barriers, 400 bytes smem, 352 bytes cmem[0]
"""

LOG_SERIALIZED = """\
ptxas info    : (C7512) Potential Performance Loss: wgmma.mma_async instructions are serialized due to insufficient register resources for the function '_ZN3bwd6kernelENS_6ParamsE'
ptxas info    : Compiling entry function '_ZN3bwd6kernelENS_6ParamsE' for 'sm_90a'
ptxas info    : Function properties for _ZN3bwd6kernelENS_6ParamsE
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 168 registers, used 16 barriers
ptxas info    : Compiling entry function '_ZN3bwd10convert_dqENS_6ParamsE' for 'sm_90a'
ptxas info    : Function properties for _ZN3bwd10convert_dqENS_6ParamsE
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 16 registers, used 0 barriers
"""

#: the same translation unit without the remark, its dQ conversion (launched with no dynamic shared memory) keeping
#: 40960 static bytes of its own; the main kernel (launched with the dynamic bytes) has none
LOG_BACKWARD_STATIC = LOG_SERIALIZED.split("\n", 1)[1].replace(
    "Used 16 registers, used 0 barriers", "Used 32 registers, used 1 barriers, 40960 bytes smem")

#: the remark for an instruction that reads an accumulator of a wgmma still in flight (it names the function
#: "in", not "for"); the line before it is an injected wait, which serializes nothing
LOG_SERIALIZED_READ = LOG_SERIALIZED.replace(
    "ptxas info    : (C7512) Potential Performance Loss: wgmma.mma_async instructions are serialized due to insufficient register resources for the function",
    "ptxas info    : (C7517) warpgroup.wait is injected in around line 4524 by compiler to allow use of registers defined by GMMA in function '_ZN3bwd6kernelENS_6ParamsE'\n"
    "ptxas info    : (C7514) Potential Performance Loss: wgmma.mma_async instructions are serialized due to non wgmma instructions reading "
    "accumulator registers of  a wgmma between start and end of the pipeline stage in the function")
