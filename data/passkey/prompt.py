"""
The passkey prompt's format and the multi-key one's, one place for the corpus that trains on it (prepare.py) and the test
that measures it (eval.py): filler text, "The pass key is NNNNN. Remember it. NNNNN is the pass
key." at a depth (a fraction of the filler before it), more filler, then the question "What is the
pass key? The pass key is". The multi-key prompt (multikey_prompt) has k such needles, each naming
whose key it is, and asks for one name's. Here in data/, beside the tokenizer, so that preparing the corpus
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


# RULER's niah_multikey (Hsieh et al. 2024, "RULER: What's the Real Context Size of Your
# Long-Context Language Models?"): k needles, each with its own name and key, the question naming
# one. Passkey can be solved by copying the only number in the prompt; here k - 1 distractors
# carry numbers of the same shape, and only the name tells the asked one apart. The names are
# words found nowhere else in the prompt, none the start of another: the question's name matches
# one needle's only
NAMES = ('apple', 'river', 'tiger', 'violin', 'copper', 'lemon', 'falcon', 'marble', 'olive',
         'pepper', 'quartz', 'salmon', 'tulip', 'walnut', 'zebra', 'cactus')
NEEDLE_OF = 'The pass key of {name} is {key}. Remember it. {key} is the pass key of {name}. '
QUESTION_OF = 'What is the pass key of {name}? The pass key of {name} is'


def answer(encode, key):
    """The ids of the answer to either prompt, ' NNNNN.', without what encode puts first (a BOS):
    the tokens a teacher-forced evaluation (eval.py) scores."""
    return encode(f' {key}.')[len(encode('')):]


def multikey_prompt(encode, length, depth, k, rng):
    """(ids, key): a multi-key prompt of `length` tokens and its asked key. k needles with k names
    and keys drawn from rng (a random.Random): the asked one after a fraction `depth` of the
    filler, the k - 1 others at depths drawn from rng, then the question for the asked name. Built
    as passkey_prompt is (each part encoded alone: the length is exact in any tokenizer)."""
    if not 1 <= k <= len(NAMES):
        raise ValueError(f"multikey needles {k}: must be in [1, {len(NAMES)}] (a name each)")
    if not 0 <= depth <= 1:
        raise ValueError(f"multikey depth {depth}: must be in [0, 1], a fraction of the filler "
                         f"before the key")
    bos = encode('')
    names = rng.sample(NAMES, k)
    keys = rng.sample(range(10000, 100000), k)
    # (depth, needle's ids), the asked needle first
    needles = [(depth, encode(NEEDLE_OF.format(name=names[0], key=keys[0]))[len(bos):])]
    for name, key in zip(names[1:], keys[1:]):
        needles.append((rng.random(), encode(NEEDLE_OF.format(name=name, key=key))[len(bos):]))
    question = encode(QUESTION_OF.format(name=names[0]))[len(bos):]
    filler = encode(FILLER * (length // 10 + 1))[len(bos):]
    room = length - len(bos) - sum(len(ids) for _, ids in needles) - len(question)
    if room < 0:
        raise ValueError(f"multikey length {length}: the {k} needles and question alone take "
                         f"{length - room} tokens")
    # the filler cut at each needle's depth, in the order of the depths (sorted is stable: a
    # distractor at the asked depth comes after the asked needle)
    ids, done = list(bos), 0
    for at, needle in sorted(needles, key=lambda n: n[0]):
        cut = round(at * room)
        ids += filler[done:cut] + needle
        done = cut
    return ids + filler[done:room] + question, keys[0]
