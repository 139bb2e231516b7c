"""The decode megakernel: build and bind csrc/megakernel.cu, its task lists, and its engine backend."""
