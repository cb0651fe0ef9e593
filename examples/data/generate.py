"""Generate the small dataset that ships in examples/data (deterministic; no network).

    uv run python examples/data/generate.py            # rewrites the files next to this script
    uv run python examples/data/generate.py --out DIR  # somewhere else

Images are drawn with PIL, videos encoded with PyAV (MPEG-4 Part 2 in .mp4: FFmpeg's built-in
encoder, present in every PyAV wheel and bit-exact between runs), parquet written with pyarrow.
See README.md in this directory for what each file holds.
"""

from __future__ import annotations

import argparse
import json
import random
from fractions import Fraction
from pathlib import Path

import av
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from PIL import Image, ImageDraw, ImageFont

HERE = Path(__file__).resolve().parent
SEED = 1234
IMAGE_SIZE = 128
COLOURS = {
    "red": (220, 40, 40), "green": (40, 170, 60), "blue": (40, 80, 220), "yellow": (235, 200, 30),
    "purple": (140, 60, 190), "orange": (245, 140, 30), "black": (20, 20, 20),
}
BACKGROUNDS = {"white": (250, 250, 250), "grey": (170, 170, 170), "light blue": (190, 220, 245)}
SHAPES = ["circle", "square", "triangle"]
WORDS = ["CAT", "SUN", "MAP", "BOX", "KEY", "OWL", "JAM", "FOX", "HAT", "CUP", "PEN", "ZIP"]
QUADRANTS = {"top-left": (8, 8), "top-right": (72, 8), "bottom-left": (8, 56), "bottom-right": (72, 56)}
NUMBER_WORDS = ["zero", "one", "two", "three", "four", "five"]


def _label(style: int, i: int, text: str) -> str:
    """Mixed CapRL option styles: "A) x", "A. x", bare "x", "(A) x"."""
    letter = "ABCDEFGH"[i]
    return [f"{letter}) {text}", f"{letter}. {text}", text, f"({letter}) {text}"][style % 4]


def _question(rng: random.Random, question: str, answer: str, pool: list[str], style: int) -> dict:
    """A QA dict with 4 options (answer + 3 distractors from pool) in a seeded order."""
    options = [answer, *rng.sample([p for p in pool if p != answer], 3)]
    rng.shuffle(options)
    return {
        "question": question,
        "choices": [_label(style, i, o) for i, o in enumerate(options)],
        "answer": "ABCD"[options.index(answer)],
    }


def _draw_shape(draw: ImageDraw.ImageDraw, shape: str, xy: tuple[int, int], colour) -> None:
    x, y = xy
    box = (x, y, x + 44, y + 44)
    if shape == "circle":
        draw.ellipse(box, fill=colour)
    elif shape == "square":
        draw.rectangle(box, fill=colour)
    else:
        draw.polygon([(x + 22, y), (x, y + 44), (x + 44, y + 44)], fill=colour)


def make_images(out: Path, rng: random.Random) -> list[dict]:
    """16 PNGs and their CapRL image rows (3-5 questions each, answers visible in the picture)."""
    (out / "images").mkdir(parents=True, exist_ok=True)
    font = ImageFont.load_default(size=18)
    rows = []
    for k in range(16):
        background = rng.choice(list(BACKGROUNDS))
        word = WORDS[k % len(WORDS)]
        places = rng.sample(list(QUADRANTS), rng.randint(1, 3))
        items = [(p, rng.choice(SHAPES), rng.choice(list(COLOURS))) for p in places]
        image = Image.new("RGB", (IMAGE_SIZE, IMAGE_SIZE), BACKGROUNDS[background])
        draw = ImageDraw.Draw(image)
        for place, shape, colour in items:
            _draw_shape(draw, shape, QUADRANTS[place], COLOURS[colour])
        draw.text((40, 104), word, fill=(0, 0, 0), font=font)
        name = f"images/img_{k:02d}.png"
        image.save(out / name, optimize=True)

        place, shape, colour = items[0]
        qa = [
            _question(rng, f"What colour is the {shape} in the {place} of the image?", colour,
                      list(COLOURS), k),
            _question(rng, "What word is written at the bottom of the image?", word, WORDS, k + 1),
            _question(rng, "How many coloured shapes are in the image?",
                      NUMBER_WORDS[len(items)], NUMBER_WORDS, k + 2),
        ]
        if k % 2 == 0:
            qa.append(_question(rng, "What colour is the background?", background,
                                [*BACKGROUNDS, "black"], k + 3))
        if k % 3 == 0:
            qa.append(_question(rng, f"Which shape is in the {place} of the image?", shape,
                                [*SHAPES, "star"], k))
        prompt = "<image> Please describe this image in detail."
        rows.append({
            "data_source": "synthetic_shapes",
            "prompt": prompt if k % 4 else [{"role": "user", "content": prompt}],
            "image": name if k % 2 else {"bytes": None, "path": name},
            "reward_model": {"style": "model", "ground_truth": qa},
            "extra_info": {"index": k, "word": word,
                           "shapes": [{"place": p, "shape": s, "colour": c} for p, s, c in items]},
        })
    return rows


VIDEO_SIZE, VIDEO_FPS, VIDEO_SECONDS = 64, 4, 5
VIDEO_COLOURS = ["red", "green", "blue", "yellow", "purple"]


def _video_events(rng: random.Random) -> list[dict]:
    """Three events at distinct whole seconds: background change, square appears, square moves."""
    times = sorted(rng.sample(range(1, VIDEO_SECONDS), 3))
    background, square = rng.sample(VIDEO_COLOURS, 2)
    return [
        {"t": times[0], "kind": "background", "colour": background,
         "text": f"the background turns {background}"},
        {"t": times[1], "kind": "appear", "colour": square,
         "text": f"a {square} square appears on the left"},
        {"t": times[2], "kind": "move", "colour": square,
         "text": f"the {square} square jumps to the right"},
    ]


def _video_frame(events: list[dict], t: float) -> np.ndarray:
    frame = np.full((VIDEO_SIZE, VIDEO_SIZE, 3), 235, np.uint8)  # [H, W, 3]
    background, appear, move = events
    if t >= background["t"]:
        frame[:] = COLOURS[background["colour"]]
    if t >= appear["t"]:
        x = 36 if t >= move["t"] else 6
        frame[20:42, x : x + 22] = COLOURS[appear["colour"]]  # [22, 22, 3]
    return frame


def _encode_video(path: Path, events: list[dict]) -> None:
    with av.open(str(path), "w", options={"fflags": "+bitexact"}) as container:
        stream = container.add_stream("mpeg4", rate=VIDEO_FPS, options={"flags": "+bitexact"})
        stream.width = stream.height = VIDEO_SIZE
        stream.pix_fmt = "yuv420p"
        stream.time_base = Fraction(1, VIDEO_FPS)
        for i in range(VIDEO_FPS * VIDEO_SECONDS):
            frame = av.VideoFrame.from_ndarray(_video_frame(events, i / VIDEO_FPS), format="rgb24")
            frame.pts = i
            container.mux(stream.encode(frame))
        container.mux(stream.encode())


def _mmss(seconds: int) -> str:
    return f"[{seconds // 60:02d}:{seconds % 60:02d}]"


def make_videos(out: Path, rng: random.Random) -> list[dict]:
    """3 tiny clips (64x64, 5 s, 4 fps) with timestamped events and CapRL video rows."""
    (out / "videos").mkdir(parents=True, exist_ok=True)
    rows = []
    stamps = [_mmss(s) for s in range(VIDEO_SECONDS)]
    for k in range(3):
        events = _video_events(rng)
        name = f"videos/clip_{k:02d}.mp4"
        _encode_video(out / name, events)
        background, appear, move = events
        order = [e["text"] for e in events]
        wrong_orders = [", then ".join(p) for p in
                        ([order[1], order[0], order[2]], [order[2], order[1], order[0]],
                         [order[0], order[2], order[1]])]
        qa = [
            _question(rng, "When does the background change colour?", _mmss(background["t"]),
                      stamps, k),
            _question(rng, f"What happens at {_mmss(appear['t'])}?", appear["text"],
                      [e["text"] for e in events] + ["the video goes black"], k + 1),
            _question(rng, "What colour is the square?", appear["colour"], VIDEO_COLOURS, k + 2),
            _question(rng, "In which order do the events happen?", ", then ".join(order),
                      [", then ".join(order), *wrong_orders], k + 3),
            _question(rng, "When does the square move to the right?", _mmss(move["t"]),
                      stamps, k),
        ]
        rows.append({
            "data_source": "synthetic_events",
            "prompt": [{"role": "user", "content": (
                "<video>\nDescribe this video in detail, in chronological order, marking every "
                "event with a [mm:ss] timestamp.")}],
            "videos": [name],
            "reward_model": {"style": "model", "ground_truth": qa},
            "extra_info": {"index": k, "fps": VIDEO_FPS, "seconds": VIDEO_SECONDS,
                           "events": [{"t": e["t"], "text": e["text"]} for e in events]},
        })
    return rows


OCR_TEMPLATES = [
    'A storefront sign that reads "{w}"', 'A coffee mug printed with the word "{w}"',
    'A neon sign glowing with the text "{w}" at night', 'A chalkboard menu that says "{w}"',
    'A red stop-style road sign with "{w}" written on it', 'A birthday cake iced with "{w}"',
    'A T-shirt with "{w}" across the chest', 'A book cover titled "{w}"',
]
OCR_WORDS = [
    "OPEN", "SALE", "HELLO", "BAKERY", "EXIT", "RELAX", "DREAM", "COFFEE", "PIZZA", "GARDEN",
    "MUSIC", "HOTEL", "RIVER", "SPACE", "TIGER", "LUCKY", "OCEAN", "BREAD", "SMILE", "PARK",
    "CINEMA", "FLOWERS", "GAME ON", "NO PARKING", "FRESH FISH", "BOOKS", "TAXI", "WELCOME HOME",
    "LIBRARY", "SUNSET", "ROBOT", "JAZZ",
]
OCR_TEST_WORDS = ["MARKET", "GOOD LUCK", "PHARMACY", "BIKES", "STUDIO", "MOON", "TEA", "ZOO"]


def make_ocr(out: Path, rng: random.Random) -> None:
    (out / "ocr").mkdir(parents=True, exist_ok=True)
    for split, words in (("train", OCR_WORDS), ("test", OCR_TEST_WORDS)):
        lines = [rng.choice(OCR_TEMPLATES).format(w=w) for w in words]
        (out / "ocr" / f"{split}.txt").write_text("\n".join(lines) + "\n", encoding="utf-8")


RIDER_SYSTEM = ("You are the support assistant of a food-delivery platform. Answer the rider's "
                "question politely, accurately and in at most three sentences.")
RIDER_QA = [
    ("payment", "When is my weekly income paid out?", "Weekly income is paid every Tuesday for the previous Monday-to-Sunday week."),
    ("payment", "Why is one order missing from my earnings?", "Earnings for an order appear after the customer confirms delivery, usually within 24 hours."),
    ("payment", "How do I change my bank account?", "Open Profile > Wallet > Bank card, add the new card and verify it with the SMS code."),
    ("order", "The restaurant is taking too long, what should I do?", "Tap 'Merchant delay' in the order page; the delivery deadline is extended and you are not penalised."),
    ("order", "The customer does not answer the phone.", "Call twice, wait five minutes at the address, then tap 'Contact failed' so support can take over."),
    ("order", "Can I cancel an order I accepted by mistake?", "You may cancel within two minutes of accepting without penalty from the order page."),
    ("order", "The food spilled during delivery.", "Report it with a photo under 'Order problem'; support will contact the customer and decide on compensation."),
    ("safety", "I had a minor traffic accident.", "Make sure you are safe, call emergency services if anyone is hurt, then report it in the app's Safety Center."),
    ("safety", "Is there insurance for riders?", "Every active delivery is covered by accident insurance; claims are filed in the Safety Center."),
    ("account", "My account was suspended, why?", "Suspensions follow repeated late deliveries or complaints; the notice in Messages states the reason and how to appeal."),
    ("account", "How do I update my vehicle type?", "Go to Profile > Vehicle, choose the new type and upload a photo of the licence or bike."),
    ("account", "I forgot my password.", "Tap 'Forgot password' on the login screen and reset it with the code sent to your phone."),
    ("schedule", "How do I book peak-hour shifts?", "Shifts open every Thursday at 10:00 under Schedule; peak slots are first come, first served."),
    ("schedule", "Can I swap a shift with another rider?", "Yes, offer the shift under Schedule > Swap at least 12 hours before it starts."),
    ("schedule", "What happens if I miss a booked shift?", "A missed shift without notice lowers your priority for booking the next week's shifts."),
    ("equipment", "Where can I get a new delivery bag?", "Order one under Profile > Equipment; it is delivered to your station within three days."),
    ("equipment", "My phone holder broke during a delivery.", "Request a replacement under Profile > Equipment; it is free once every six months."),
    ("payment", "Are tips paid to me in full?", "Yes, customers' tips go to you in full with the weekly payout."),
    ("order", "The address on the order is wrong.", "Call the customer to confirm, then tap 'Edit address' if it is within 1 km, or contact support."),
    ("safety", "It is raining heavily, do I have to keep working?", "No, you can go offline at any time; rain bonuses apply only while you choose to work."),
]
RM_QUALITY = ("You are grading a support reply to a food-delivery rider.\n"
              "Question: {question}\nReference answer: {reference}\n"
              "Reply: {{response}}\n"
              "Rate how correct and helpful the reply is, from 0 to 10. Answer with the number only.")
RM_CONSISTENCY = ("Does the reply below contradict the platform policy stated in the reference?\n"
                  "Reference: {reference}\nReply: {{response}}\nAnswer Yes or No.")


def make_rider(out: Path) -> None:
    """20 verl-style judge rows: 16 train, 4 val (rm_prompt_1 empty on every fourth row)."""
    (out / "rider").mkdir(parents=True, exist_ok=True)
    rows = []
    for i, (category, question, reference) in enumerate(RIDER_QA):
        rows.append({
            "data_source": "rider_synthetic",
            "prompt": [{"role": "system", "content": RIDER_SYSTEM},
                       {"role": "user", "content": question}],
            "rm_prompt_0": RM_QUALITY.format(question=question, reference=reference),
            "rm_prompt_1": "" if i % 4 == 3 else RM_CONSISTENCY.format(reference=reference),
            "reward_model": {"style": "model", "ground_truth": reference},
            "extra_info": {"split": "train" if i < 16 else "val", "index": i, "category": category},
        })
    for split, part in (("train", rows[:16]), ("val", rows[16:])):
        pq.write_table(pa.Table.from_pylist(part), out / "rider" / f"{split}.parquet")


def make_prompts(out: Path) -> None:
    """8 plain prompts (strings and chat messages) with free fields, for custom apps."""
    rows = [{"prompt": f"Write one sentence about a {w.lower()}.", "id": i, "topic": w.lower()}
            for i, w in enumerate(WORDS[:6])]
    rows += [{"prompt": [{"role": "user", "content": "Name three primary colours."}], "id": 6},
             {"prompt": [{"role": "system", "content": "Answer in one word."},
                         {"role": "user", "content": "What colour is the sky?"}], "id": 7}]
    _write_jsonl(out / "prompts.jsonl", rows)


PREFERENCE_SIZE = 32


def _preference_image(shape: str, colour: str, background: str, x: int = 8) -> Image.Image:
    image = Image.new("RGB", (PREFERENCE_SIZE, PREFERENCE_SIZE), BACKGROUNDS[background])
    draw = ImageDraw.Draw(image)
    box = (x, 8, x + 16, 24)
    (draw.ellipse if shape == "circle" else draw.rectangle)(box, fill=COLOURS[colour])
    return image


def make_preference(out: Path) -> None:
    """3 Diffusion-DPO preference pairs: two of 32x32 PNGs, one of 4-frame GIF clips (4 fps);
    the chosen member matches the prompt, the rejected one gets one thing wrong."""
    (out / "preference" / "images").mkdir(parents=True, exist_ok=True)
    (out / "preference" / "videos").mkdir(parents=True, exist_ok=True)
    images = {
        "red_circle": _preference_image("circle", "red", "white"),
        "blue_circle": _preference_image("circle", "blue", "white"),
        "green_square": _preference_image("square", "green", "grey"),
        "green_circle": _preference_image("circle", "green", "grey"),
    }
    for name, image in images.items():
        image.save(out / "preference" / "images" / f"{name}.png", optimize=True)
    for name, xs in (("square_left_to_right", (0, 5, 10, 16)), ("square_right_to_left", (16, 10, 5, 0))):
        frames = [_preference_image("square", "yellow", "white", x) for x in xs]
        frames[0].save(out / "preference" / "videos" / f"{name}.gif", save_all=True,
                       append_images=frames[1:], duration=250, loop=0)
    rows = [
        {"prompt": "a red circle on a white background", "chosen": "images/red_circle.png",
         "rejected": "images/blue_circle.png", "id": 0},
        {"prompt": "a green square on a grey background", "chosen": "images/green_square.png",
         "rejected": "images/green_circle.png", "id": 1},
        {"prompt": "a yellow square moving from left to right",
         "chosen": "videos/square_left_to_right.gif", "rejected": "videos/square_right_to_left.gif",
         "id": 2},
    ]
    _write_jsonl(out / "preference" / "pairs.jsonl", rows)


def _shapes_image(rng: random.Random, shift: int = 0) -> Image.Image:
    """A 32x32 picture of two shapes in mid-tone colours on a mid-grey background, moved `shift` px right."""
    image = Image.new("RGB", (PREFERENCE_SIZE, PREFERENCE_SIZE), (128, 128, 128))
    draw = ImageDraw.Draw(image)
    for _ in range(2):
        x, y, side = rng.randrange(0, 16), rng.randrange(0, 16), rng.randrange(8, 16)
        colour = tuple(rng.randrange(64, 192) for _ in range(3))
        (draw.ellipse if rng.random() < 0.5 else draw.rectangle)((x + shift, y, x + shift + side, y + side), fill=colour)
    return image


def _lighter(image: Image.Image, towards: int) -> Image.Image:
    """Half-way from `image` to a plain `towards` grey level (255: lighter, 0: darker)."""
    return Image.blend(image, Image.new("RGB", image.size, (towards,) * 3), 0.5)


def make_brightness_pairs(out: Path) -> None:
    """Diffusion-DPO pairs that differ only in brightness, for the tiny models' brightness reward: 16
    image pairs (PNGs) for the first 16 OCR training prompts, 8 video pairs (5-frame GIFs, shapes
    moving right) for the first 8; the chosen member is the lighter copy of one picture."""
    root = out / "preference" / "brightness"
    (root / "images").mkdir(parents=True, exist_ok=True)
    (root / "videos").mkdir(parents=True, exist_ok=True)
    rng = random.Random(SEED + 1)  # its own draws: the files above stay as they were
    prompts = (out / "ocr" / "train.txt").read_text(encoding="utf-8").splitlines()
    images, videos = [], []
    for i, prompt in enumerate(prompts[:16]):
        picture = _shapes_image(rng)
        for kind, level in (("chosen", 255), ("rejected", 0)):
            _lighter(picture, level).save(root / "images" / f"{i:02d}_{kind}.png", optimize=True)
        images.append({"prompt": prompt, "chosen": f"images/{i:02d}_chosen.png",
                       "rejected": f"images/{i:02d}_rejected.png", "id": i})
    for i, prompt in enumerate(prompts[:8]):
        state = rng.getstate()
        frames = []
        for t in range(5):
            rng.setstate(state)  # the same shapes in every frame, moved 2 px a frame
            frames.append(_shapes_image(rng, shift=2 * t))
        for kind, level in (("chosen", 255), ("rejected", 0)):
            clip = [_lighter(frame, level) for frame in frames]
            clip[0].save(root / "videos" / f"{i:02d}_{kind}.gif", save_all=True, append_images=clip[1:],
                         duration=125, loop=0)
        videos.append({"prompt": prompt, "chosen": f"videos/{i:02d}_chosen.gif",
                       "rejected": f"videos/{i:02d}_rejected.gif", "id": i})
    _write_jsonl(root / "images.jsonl", images)
    _write_jsonl(root / "videos.jsonl", videos)


def _write_jsonl(path: Path, rows: list[dict]) -> None:
    text = "".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows)
    path.write_text(text, encoding="utf-8")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=HERE)
    out = parser.parse_args().out
    out.mkdir(parents=True, exist_ok=True)
    rng = random.Random(SEED)
    _write_jsonl(out / "caption_qa_images.jsonl", make_images(out, rng))
    _write_jsonl(out / "caption_qa_videos.jsonl", make_videos(out, rng))
    make_ocr(out, rng)
    make_rider(out)
    make_prompts(out)
    make_preference(out)
    make_brightness_pairs(out)


if __name__ == "__main__":
    main()
