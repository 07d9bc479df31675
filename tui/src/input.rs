//! Keys to commands. A pure function of (UI state, key) so that the dialog flow is
//! testable without a terminal; the Dashboard only feeds it crossterm's key events.

use ratatui::crossterm::event::{KeyCode, KeyEvent, KeyEventKind, KeyModifiers};

/// What the dashboard asks of the watcher. Everything else the keys do (overlays)
/// stays inside the dashboard.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Command {
    Quit,
    /// Only returned after the user confirmed with 'y' in the confirm dialog.
    Inject,
    /// The new pause state ('p' toggles it).
    Pause(bool),
}

/// Which dialog, if any, is over the panels. One at a time: a dialog takes every key.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Overlay {
    #[default]
    None,
    Help,
    ConfirmInject,
}

/// The dashboard's own state: what the keys change.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct UiState {
    pub overlay: Overlay,
    pub paused: bool,
}

/// Applies one key to `ui`; returns the command for the watcher, if any.
///
/// Ctrl-C quits from anywhere: raw mode turns it into a key, so it must never be
/// swallowed by a dialog. 'q' quits from the panels and the help; in the confirm
/// dialog only y / n / Esc count, so that a stray key can neither inject nor quit.
pub fn handle_key(ui: &mut UiState, key: KeyEvent) -> Option<Command> {
    // Release/repeat events only arrive with the kitty protocol, which is not
    // enabled; ignoring them keeps a held key from toggling twice if it ever is.
    if key.kind != KeyEventKind::Press {
        return None;
    }
    if key.modifiers.contains(KeyModifiers::CONTROL)
        && matches!(key.code, KeyCode::Char('c') | KeyCode::Char('C'))
    {
        return Some(Command::Quit);
    }
    match ui.overlay {
        Overlay::ConfirmInject => match key.code {
            KeyCode::Char('y') | KeyCode::Char('Y') => {
                ui.overlay = Overlay::None;
                Some(Command::Inject)
            }
            KeyCode::Char('n') | KeyCode::Char('N') | KeyCode::Esc => {
                ui.overlay = Overlay::None;
                None
            }
            _ => None,
        },
        Overlay::Help => match key.code {
            KeyCode::Char('?') | KeyCode::Esc => {
                ui.overlay = Overlay::None;
                None
            }
            KeyCode::Char('q') => Some(Command::Quit),
            _ => None,
        },
        Overlay::None => match key.code {
            KeyCode::Char('?') => {
                ui.overlay = Overlay::Help;
                None
            }
            KeyCode::Char('i') => {
                ui.overlay = Overlay::ConfirmInject;
                None
            }
            KeyCode::Char('p') => {
                ui.paused = !ui.paused;
                Some(Command::Pause(ui.paused))
            }
            KeyCode::Char('q') => Some(Command::Quit),
            _ => None,
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(c: char) -> KeyEvent {
        KeyEvent::new(KeyCode::Char(c), KeyModifiers::NONE)
    }

    fn esc() -> KeyEvent {
        KeyEvent::new(KeyCode::Esc, KeyModifiers::NONE)
    }

    #[test]
    fn inject_only_after_y() {
        let mut ui = UiState::default();
        assert_eq!(handle_key(&mut ui, key('i')), None);
        assert_eq!(ui.overlay, Overlay::ConfirmInject);
        // Keys other than y/n/Esc neither inject, quit nor close the dialog.
        for c in ['x', 'q', 'p', '?', 'i'] {
            assert_eq!(handle_key(&mut ui, key(c)), None, "key {c}");
            assert_eq!(ui.overlay, Overlay::ConfirmInject);
        }
        assert!(!ui.paused);
        assert_eq!(handle_key(&mut ui, key('y')), Some(Command::Inject));
        assert_eq!(ui.overlay, Overlay::None);
        // A 'y' with no dialog open does nothing.
        assert_eq!(handle_key(&mut ui, key('y')), None);
    }

    #[test]
    fn n_and_esc_cancel_the_dialog() {
        let mut ui = UiState::default();
        for cancel in [key('n'), esc()] {
            handle_key(&mut ui, key('i'));
            assert_eq!(handle_key(&mut ui, cancel), None);
            assert_eq!(ui.overlay, Overlay::None);
        }
    }

    #[test]
    fn help_toggles_and_esc_closes() {
        let mut ui = UiState::default();
        handle_key(&mut ui, key('?'));
        assert_eq!(ui.overlay, Overlay::Help);
        handle_key(&mut ui, key('?'));
        assert_eq!(ui.overlay, Overlay::None);
        handle_key(&mut ui, key('?'));
        // 'i' in the help does not open the dialog on top of it.
        assert_eq!(handle_key(&mut ui, key('i')), None);
        assert_eq!(ui.overlay, Overlay::Help);
        handle_key(&mut ui, esc());
        assert_eq!(ui.overlay, Overlay::None);
    }

    #[test]
    fn pause_toggles() {
        let mut ui = UiState::default();
        assert_eq!(handle_key(&mut ui, key('p')), Some(Command::Pause(true)));
        assert_eq!(handle_key(&mut ui, key('p')), Some(Command::Pause(false)));
    }

    #[test]
    fn quit_keys() {
        let ctrl_c = KeyEvent::new(KeyCode::Char('c'), KeyModifiers::CONTROL);
        for overlay in [Overlay::None, Overlay::Help, Overlay::ConfirmInject] {
            let mut ui = UiState {
                overlay,
                paused: false,
            };
            assert_eq!(handle_key(&mut ui, ctrl_c), Some(Command::Quit));
        }
        let mut ui = UiState::default();
        assert_eq!(handle_key(&mut ui, key('q')), Some(Command::Quit));
        // A plain 'c' is not Ctrl-C.
        assert_eq!(handle_key(&mut ui, key('c')), None);
    }

    #[test]
    fn key_releases_are_ignored() {
        let mut ui = UiState::default();
        let mut release = key('p');
        release.kind = KeyEventKind::Release;
        assert_eq!(handle_key(&mut ui, release), None);
        assert!(!ui.paused);
    }
}
