"""The EXL3 encoder: Viterbi trellis quantizer, regularisation, LDLQ, converters."""
