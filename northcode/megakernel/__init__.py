"""The decode megakernel: build and bind csrc/megakernel.cu, its task lists and variants, and its engine backend."""
