//! Regenerates `data/corpus.txt`, the byte-level language-modelling corpus of `kimi_burn::data`.
//!
//! ```bash
//! cargo run --example make_corpus > data/corpus.txt
//! ```
//!
//! Everything here is self-written: a few paragraphs about the corpus itself, then text from a
//! small seeded grammar (short stories whose characters recur, counting, arithmetic facts,
//! weather reports). The grammar gives a tiny model structure to learn at several ranges: spelling
//! within words, agreement within sentences, names and numbers across sentences.
// Reading tensors back is this program's business: the crate's read counter covers the library.
#![allow(clippy::disallowed_methods)]

use std::io::Write;

use kimi_burn::data::SeededRng;

/// Stop once the corpus reaches this many bytes (the crate ships it; keep it ≤ 200 KB).
const TARGET_BYTES: usize = 150_000;

const PREFACE: &str = "\
This corpus was written for the byte-level language modelling task of kimi-burn. It is small on \
purpose: a model with a few hundred thousand parameters should be able to read all of it many \
times in a few minutes on a laptop, and its loss should fall well below eight bits per byte.

Most of what follows comes from a tiny grammar. The stories are short and plain. People walk to \
places, find things, and tell each other what they found. The same names come back a few \
sentences later, so a model that remembers who is in the story predicts the next word better \
than one that only knows spelling. The sums are always right, so a model can learn that seven \
plus five is twelve, and the counting always goes up by one.

None of this text is meant to be read for pleasure. It is meant to be predictable in some places \
and surprising in others, which is what a small test of a sequence model needs.

";

const NAMES: [&str; 16] = [
    "Ada", "Bram", "Cleo", "Dov", "Esme", "Finn", "Gus", "Hana", "Ivo", "Juno", "Kit", "Lior",
    "Mira", "Nils", "Oona", "Pim",
];
const PLACES: [&str; 12] = [
    "the river",
    "the old mill",
    "the market",
    "the hill",
    "the harbour",
    "the library",
    "the orchard",
    "the bridge",
    "the bakery",
    "the lighthouse",
    "the forest",
    "the station",
];
const THINGS: [&str; 14] = [
    "a red kite",
    "a small key",
    "a blue cup",
    "a map",
    "a lantern",
    "a wooden box",
    "a letter",
    "a green apple",
    "a silver coin",
    "a feather",
    "a warm loaf",
    "a compass",
    "a book",
    "a shell",
];
const ADJECTIVES: [&str; 10] = [
    "quiet", "busy", "cold", "bright", "windy", "foggy", "sunny", "crowded", "empty", "warm",
];
const FEELINGS: [&str; 6] = ["happy", "surprised", "curious", "tired", "proud", "calm"];
const TIMES: [&str; 6] = [
    "In the morning",
    "At noon",
    "In the evening",
    "Late at night",
    "After lunch",
    "At dawn",
];
const WEATHER: [&str; 6] = ["rain", "snow", "sun", "wind", "fog", "clouds"];
const DAYS: [&str; 7] = [
    "Monday",
    "Tuesday",
    "Wednesday",
    "Thursday",
    "Friday",
    "Saturday",
    "Sunday",
];
const UNITS: [&str; 20] = [
    "zero",
    "one",
    "two",
    "three",
    "four",
    "five",
    "six",
    "seven",
    "eight",
    "nine",
    "ten",
    "eleven",
    "twelve",
    "thirteen",
    "fourteen",
    "fifteen",
    "sixteen",
    "seventeen",
    "eighteen",
    "nineteen",
];
const TENS: [&str; 10] = [
    "", "", "twenty", "thirty", "forty", "fifty", "sixty", "seventy", "eighty", "ninety",
];

fn pick<'a>(rng: &mut SeededRng, items: &[&'a str]) -> &'a str {
    items[rng.below(items.len())]
}

/// `n < 100` in words.
fn number(n: usize) -> String {
    match n {
        0..=19 => UNITS[n].to_string(),
        _ if n.is_multiple_of(10) => TENS[n / 10].to_string(),
        _ => format!("{}-{}", TENS[n / 10], UNITS[n % 10]),
    }
}

fn capitalise(s: &str) -> String {
    let mut chars = s.chars();
    chars.next().map_or_else(String::new, |c| {
        c.to_uppercase().collect::<String>() + chars.as_str()
    })
}

fn story(rng: &mut SeededRng) -> String {
    let hero = pick(rng, &NAMES);
    let friend = loop {
        let f = pick(rng, &NAMES);
        if f != hero {
            break f;
        }
    };
    let place = pick(rng, &PLACES);
    let thing = pick(rng, &THINGS);
    let mut s = format!(
        "{} {} walked to {}. It was {} there. ",
        pick(rng, &TIMES),
        hero,
        place,
        pick(rng, &ADJECTIVES)
    );
    s += &format!("Near {place}, {hero} found {thing}. ");
    s += &format!("{hero} felt {}. ", pick(rng, &FEELINGS));
    match rng.below(3) {
        0 => {
            s += &format!(
                "\"Look what I found,\" said {hero}. \"Where?\" asked {friend}. \"At {place},\" \
                 said {hero}. "
            );
        }
        1 => {
            s += &format!(
                "{hero} gave {thing} to {friend}. {friend} said thank you and took it home. "
            );
        }
        _ => {
            let other = pick(rng, &PLACES);
            s += &format!("Then {hero} carried {thing} to {other}, where {friend} was waiting. ");
        }
    }
    s += &format!("That was the end of the day for {hero}.\n");
    s
}

fn sums(rng: &mut SeededRng) -> String {
    let mut s = String::new();
    for _ in 0..4 {
        let a = rng.below(50);
        let b = rng.below(50);
        if rng.below(2) == 0 {
            let sum = format!("{} plus {} is {}. ", number(a), number(b), number(a + b));
            s += &capitalise(&sum);
        } else {
            let (hi, lo) = (a.max(b), a.min(b));
            s += &format!("{hi} minus {lo} is {}. ", hi - lo);
        }
    }
    s.pop();
    s + "\n"
}

fn counting(rng: &mut SeededRng) -> String {
    let start = rng.below(80);
    let len = 4 + rng.below(8);
    let words: Vec<String> = (start..(start + len).min(100)).map(number).collect();
    capitalise(&words.join(", ")) + ".\n"
}

fn weather(rng: &mut SeededRng) -> String {
    let day = rng.below(DAYS.len());
    let mut s = format!("Weather for {}: ", DAYS[day]);
    for offset in 1..=3 {
        let d = DAYS[(day + offset) % DAYS.len()];
        let temp = 5 + rng.below(20);
        s += &format!("{d}, {} and {temp} degrees. ", pick(rng, &WEATHER));
    }
    s.pop();
    s + "\n"
}

fn main() -> std::io::Result<()> {
    let mut rng = SeededRng::new(2025);
    let mut corpus = String::from(PREFACE);
    while corpus.len() < TARGET_BYTES {
        let paragraph = match rng.below(10) {
            0..=5 => story(&mut rng),
            6 | 7 => sums(&mut rng),
            8 => counting(&mut rng),
            _ => weather(&mut rng),
        };
        corpus += &paragraph;
    }
    std::io::stdout().lock().write_all(corpus.as_bytes())
}
