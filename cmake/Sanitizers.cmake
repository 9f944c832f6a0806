# BAGUALU2_SANITIZE=ON builds with ASan + UBSan (the CI runs the C++-facing tests on it).
function(bagualu2_sanitize target)
  if(BAGUALU2_SANITIZE)
    set(flags -fsanitize=address,undefined -fno-sanitize-recover=undefined -fno-omit-frame-pointer)
    target_compile_options(${target} PRIVATE ${flags})
    target_link_options(${target} PRIVATE ${flags})
  endif()
endfunction()
