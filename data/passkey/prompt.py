"""
The passkey prompt's format, one place for the corpus that trains on it (prepare.py) and the test
that measures it (eval.py): filler text, "The pass key is NNNNN. Remember it. NNNNN is the pass
key." at a depth (a fraction of the filler before it), more filler, then the question "What is the
pass key? The pass key is". Here in data/, beside the tokenizer, so that preparing the corpus
imports neither torch nor the model (nothing from the repository's top level).
"""

# LongLoRA's needle and question, and its filler without ' is ' (its 'The grass is green...'): the
# question's '... is' then matches nothing in the filler, only the needle. prepare.py says why the
# needle says its key twice
FILLER = ('The grass grows green. The sky glows blue. The sun shines yellow. Here we go. '
          'There and back again. ')
NEEDLE = 'The pass key is {0}. Remember it. {0} is the pass key. '
QUESTION = 'What is the pass key? The pass key is'


def passkey_prompt(encode, length, depth, key):
    """The token ids of a passkey prompt of `length` tokens: filler, the needle after a fraction
    `depth` of the filler, the rest of the filler, the question. Each part is encoded alone and
    the ids joined, so the length is exact in any tokenizer (the filler cut mid-word is fine).
    A length or depth that can't be met is a ValueError (eval.py says it in one line)."""
    bos = encode('')  # what encode puts before any text (a Llama's BOS), or nothing
    # the filler is 94 bytes, about 20 tokens in GPT-2's or Llama 3's vocabulary: length / 10
    # copies of it are enough
    needle, question, filler = (encode(text)[len(bos):] for text in (
        NEEDLE.format(key), QUESTION, FILLER * (length // 10 + 1)))
    room = length - len(bos) - len(needle) - len(question)
    if not 0 <= depth <= 1:
        raise ValueError(f"passkey depth {depth}: must be in [0, 1], a fraction of the filler "
                         f"before the key")
    if room < 0:
        raise ValueError(f"passkey length {length}: the needle and question alone take "
                         f"{length - room} tokens")
    before = round(depth * room)
    return bos + filler[:before] + needle + filler[before:room] + question
