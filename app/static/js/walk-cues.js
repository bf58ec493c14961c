// Cues a person can take in with eyes on the path, for the walk page: speech (the Web Speech API,
// which phones run offline), vibration, the screen kept awake and full screen. Every one is optional:
// a browser without it simply goes without (the page says once on screen when there is no speech).

const MUTE_KEY = "djev_walk_muted";

// Two patterns a hand can tell apart without looking: danger is three quick pulses, "no answer" one
// long buzz.
export const VIBRATION = { danger: [120, 80, 120, 80, 120], noAnswer: [700] };

// A cleared danger is said ("clear") only once the path has stayed clear this long, so that one clear
// frame between two danger frames does not make the phone say "clear".
export const CLEAR_HOLD_MS = 800;

export const NO_ANSWER_SPOKEN = "no answer, stop";

// What the phone says for each hazard label (the labels are the model's; these are for the ear).
const PHRASES = {
  "all clear ahead": "clear",
  "danger: stairs": "stairs ahead",
  "danger: wall ahead": "wall ahead",
  "danger: object ahead": "object ahead",
  "danger: pet ahead": "animal ahead",
  "door ahead": "door ahead",
};

// `label` is the hazard, `obstacle` "left" | "right" | null (the side question's answer).
export function phraseFor(label, obstacle) {
  const phrase = PHRASES[label] ?? label.replace(/^danger:\s*/, "");
  return obstacle ? `${phrase}, obstacle on the ${obstacle}` : phrase;
}

export function vibrate(pattern) {
  if (typeof navigator.vibrate !== "function") return; // Safari has none; nothing to say about it
  try { navigator.vibrate(pattern); } catch (_) { /* a browser that refuses: the voice and screen remain */ }
}

// The voice: the page language (the <html lang>) picks the utterance language and, where the phone
// has one, a matching voice.
export class Voice {
  constructor() {
    const synth = window.speechSynthesis;
    this.synth = synth && typeof synth.speak === "function" && typeof window.SpeechSynthesisUtterance === "function"
      ? synth : null;
    this.muted = localStorage.getItem(MUTE_KEY) === "1";
  }

  get available() {
    return this.synth !== null;
  }

  setMuted(muted) {
    this.muted = muted;
    if (muted) localStorage.setItem(MUTE_KEY, "1");
    else localStorage.removeItem(MUTE_KEY);
    if (muted) this.silence();
  }

  say(text, { interrupt = false } = {}) {
    if (!this.synth || this.muted) return;
    try {
      if (interrupt) this.synth.cancel();
      const utterance = new SpeechSynthesisUtterance(text);
      utterance.lang = document.documentElement.lang || navigator.language || "en";
      const voice = this.voiceFor(utterance.lang);
      if (voice) utterance.voice = voice;
      this.synth.speak(utterance);
    } catch (_) { /* speech failing must not stop the page */ }
  }

  voiceFor(lang) {
    const voices = this.synth.getVoices?.() ?? [];
    const base = lang.toLowerCase().split("-")[0];
    return voices.find((v) => v.lang?.toLowerCase() === lang.toLowerCase())
      ?? voices.find((v) => v.lang?.toLowerCase().split(/[-_]/)[0] === base) ?? null;
  }

  silence() {
    try { this.synth?.cancel(); } catch (_) { /* nothing to silence */ }
  }
}

// When to speak and buzz. A change is said at once, a repeat never; a danger (and "no answer")
// interrupts anything being said and vibrates; "clear" waits for CLEAR_HOLD_MS of clear answers.
export class Announcer {
  constructor(voice) {
    this.voice = voice;
    this.last = null; // the phrase last announced (spoken or, muted, would have been)
    this.clearSince = null; // when the current run of clear answers began
  }

  reset() {
    this.last = null;
    this.clearSince = null;
    this.voice.silence();
  }

  // A fresh answer. kind: "clear" | "danger" | "door".
  answer(kind, phrase, now) {
    if (kind !== "clear") {
      this.clearSince = null;
      if (phrase !== this.last) this.announce(phrase, kind);
      return;
    }
    if (this.clearSince === null) this.clearSince = now;
    if (phrase !== this.last && now - this.clearSince >= CLEAR_HOLD_MS) this.announce(phrase, kind);
  }

  noAnswer() {
    this.clearSince = null;
    if (this.last !== NO_ANSWER_SPOKEN) this.announce(NO_ANSWER_SPOKEN, "noAnswer");
  }

  announce(phrase, kind) {
    this.last = phrase;
    const urgent = kind === "danger" || kind === "noAnswer";
    this.voice.say(phrase, { interrupt: urgent });
    if (urgent) vibrate(VIBRATION[kind]);
  }
}

// The Screen Wake Lock: held while the loop runs. The browser drops it whenever the page is hidden,
// so the page asks again when it becomes visible.
export class ScreenLock {
  constructor() {
    this.sentinel = null;
    this.wanted = false;
  }

  async acquire() {
    this.wanted = true;
    if (this.sentinel || document.hidden || !navigator.wakeLock?.request) return;
    try {
      const sentinel = await navigator.wakeLock.request("screen");
      if (!this.wanted) {
        sentinel.release().catch(() => {});
        return;
      }
      this.sentinel = sentinel;
      sentinel.addEventListener?.("release", () => { if (this.sentinel === sentinel) this.sentinel = null; });
    } catch (_) { /* refused (battery saver, no permission): the screen may sleep */ }
  }

  release() {
    this.wanted = false;
    const sentinel = this.sentinel;
    this.sentinel = null;
    sentinel?.release().catch(() => {});
  }

  // Called when the page is visible again; the lock the browser dropped is taken back.
  regain() {
    if (!this.wanted) return;
    this.sentinel = null;
    this.acquire();
  }
}

// Full screen on Start (a user gesture), unless already there or launched full screen from the
// home screen.
export function enterFullscreen() {
  const root = document.documentElement;
  if (document.fullscreenElement || !root.requestFullscreen) return;
  if (window.matchMedia?.("(display-mode: fullscreen)").matches) return;
  root.requestFullscreen({ navigationUI: "hide" }).catch(() => {});
}

export function exitFullscreen() {
  if (document.fullscreenElement && document.exitFullscreen) document.exitFullscreen().catch(() => {});
}
